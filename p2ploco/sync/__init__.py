"""A round's sync: the group forms (``form.py``), its members reduce
(``reduce.py``) and decide one outcome for all (``decide.py``); ``communicator.py`` runs the sync through them."""
