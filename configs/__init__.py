"""Experiment configs (ml_collections): base.py holds every default, the others change a few."""
