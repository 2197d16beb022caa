"""Math several ops share, each rule written once: a Triton helper beside its PyTorch
reference (DCP ownership and localisation, page -> cache slot), and masks built alike by every
Triton release."""
