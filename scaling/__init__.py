"""How many workers the fleet needs: the desired-workers formula (`desired.py`), shared by the gateway's
autoscaling signal and the fleet simulator (`simulator/`)."""
