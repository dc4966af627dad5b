"""Taking a trained model out of p2ploco: checkpoints to formats other tools load (``hf.py``)."""
