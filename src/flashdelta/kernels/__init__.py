"""Hopper (SM90) TileLang kernels, one launcher per stage of docs/stages.md; `sm90` declares the kernel set that
`flashdelta.dispatch` loads at call time. Importing this package imports nothing (no TileLang)."""
