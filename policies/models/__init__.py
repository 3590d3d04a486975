"""pi0.5 model pieces: SigLIP (siglip.py), Gemma blocks (gemma.py), the full model (pi05.py) and
the plain reference forward (reference.py)."""
