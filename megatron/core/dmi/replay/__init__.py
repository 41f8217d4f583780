"""Route replay from a DMI store: train under the top-k experts a stored run recorded.

``extract.py`` runs in a subprocess (chDB holds one store per process, and a training run may hold
its own): it opens the source store with the reader, checks that the stored run fits this run, and
writes exactly this rank's routing (its layers, its microbatches' tokens, every stored iteration)
into a compact file. ``routing.py`` attaches megatron-core's own ``RouterReplay`` to each of this
rank's routers and, before every forward, hands it the stored selection of that microbatch.
"""
