"""Studies: end-to-end experiments that train, measure and write a committed report."""
