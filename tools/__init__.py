"""Maintainer scripts (not part of the installed packages), e.g. train_default_model.py."""
