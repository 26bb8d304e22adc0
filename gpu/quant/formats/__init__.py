"""One checkpoint format's reader per file; SCHEMES in the parent package's scheme module names them."""
