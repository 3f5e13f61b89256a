"""Optional accelerated kernels; each has a pure-torch twin in ``attention/`` and is tested against it."""
