"""Image inputs on the ranks: pixels to patches (pixels.py), the encoder step feature."""
