"""Measuring on a device: the candidates' builds timed where they will run (this CPU, a local
GPU, or a device behind TVM's RPC tracker), checked against the reference, and the faster kept;
without a device, the choice that holds under every constant set the model allows.

``device`` reaches a device, ``timing`` times a build and its kernels there, ``trials`` runs
the candidates through the device's timing cache (``cost.timing_cache``), ``regret`` chooses
when nothing can be measured.
"""
