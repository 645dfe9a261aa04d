"""Drop-in modules for programs written against other MPI libraries for JAX.

``import jaxcomm.compat.mpi4jax as mpi4jax`` runs a program written for
mpi4jax 0.9 on jaxcomm (``docs/migration-mpi4jax.md``).
"""
