"""Goldfish loss (000 §VIII-D; Hans et al., arXiv 2406.10209): a hashed token mask that keeps a model from reproducing training sequences verbatim, and the memorization measure."""
