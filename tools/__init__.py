"""Tools beside the library: studies that use hvd_lm but that the library does not import."""
