"""A round's sync: the group forms (``form.py``), its members reduce (``reduce.py``) and decide one outcome for all
(``decide.py``: the votes; ``tally.py``: counting them); ``communicator.py`` runs the sync through them."""
