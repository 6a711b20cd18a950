"""kvlab: inference-aware model design.

`kvlab.plan` is pure arithmetic (stdlib only); `kvlab.nn` and `kvlab.cache` are the PyTorch
lab built on it. Import the sub-package you need: this top level imports nothing heavy.
"""

__version__ = "0.1.0"
