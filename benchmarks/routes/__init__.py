"""The routes of other libraries, beside the package's own (``jaxcomm.bench.routes``).

- :mod:`.mpi4jax_functions`: mpi4jax's functions, where it is installed;
- :mod:`.jax_shard_map`: JAX's own collectives over ``jax.distributed``, and
  jaxcomm's inside the same ``shard_map`` programs.
"""
