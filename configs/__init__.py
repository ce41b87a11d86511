"""Cluster presets (clusters/*.yaml) and example plans (plans/*.yaml), shipped as package data."""
