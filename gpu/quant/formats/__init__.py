"""One checkpoint format's reader per file (gpu/quant/scheme.py SCHEMES names them)."""
