"""V-JEPA 2 (``vjepa2``) and V-JEPA 2-AC (``vjepa2_ac``): a video encoder, its masked predictor and
its action-conditioned predictor."""
