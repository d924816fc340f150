"""`specdec generate` beside the decoder: configurations compared, and whether the draft pays
on this machine (calibration)."""
