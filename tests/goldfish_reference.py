"""The Goldfish rule written out by hand for the tests (shares no code with ds_ext.goldfish)."""


def reference_keep(seq: list[int], k: int, h: int) -> list[bool]:
    """The rule as the module docstring states it, one token at a time in plain Python ints."""
    keep = []
    for i in range(len(seq)):
        if i < h:
            keep.append(True)
            continue
        a = 0
        for x in seq[i - h : i]:
            a = (a * 1000003 + x + 1) % 2147483647
        for _ in range(2):
            a ^= a >> 16
            a = (a * 73244475) % 4294967296
        a ^= a >> 16
        keep.append(not a < 4294967296 / k)
    return keep
