"""eagle3-ray: Ray-native training of EAGLE-3 speculative-decoding drafters."""

__version__ = "0.1.0"
