"""Whole jobs built from the parts below: launch-script rendering and sweeps, the end-to-end
demo, its report, and the verified corpus download."""
