"""An emulated cluster on one host: nodes as network namespaces joined by ``tc tbf``-shaped
links (one per node, or one per GPU as Frontier's NICs; with ``--gcd-rate`` also one per GCD,
so that every level is shaped), ranks started inside them with launcher semantics
(``ds-ext cluster``).

Timing measured on it comes from the kernel's token buckets and gloo's TCP traffic, not
from ds_ext's own alpha-beta model (``ds_ext.comm`` emulation), so it can test that model.

* :mod:`~ds_ext.cluster.spec`: the cluster's shape and link rates (flags or a topology block);
* :mod:`~ds_ext.cluster.netns`: namespaces, bridges, veths, qdiscs; capability check; cleanup
  and the sweep of a killed run's leftovers;
* :mod:`~ds_ext.cluster.launch`: ranks started in their namespaces;
* :mod:`~ds_ext.cluster.measure`: per-level bandwidth and latency measured by the ranks;
* :mod:`~ds_ext.cluster.wire`: bytes on the wire, the kernel's counters of every link per
  direction and level, beside the ledger's;
* :mod:`~ds_ext.cluster.world`: the benchmarks' worker pool placed on a cluster (``--network netns``);
* :mod:`~ds_ext.cluster.command`: the ``ds-ext cluster`` command (also ``python -m ds_ext.cluster``)
  and its shared flags.
"""
