"""BMTrain's model-building classes, lowered onto fbmt.compile (see module.py, NOTE: [Lowering])."""
