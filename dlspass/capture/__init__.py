"""Capturing a training step as one pure FX graph (forward, backward, optimizer update)."""
