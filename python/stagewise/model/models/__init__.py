"""The architectures: how each builds its decoder layers from a stage's named weights."""
