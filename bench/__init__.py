"""kvroom's benchmark: python -m bench [--quick]."""
