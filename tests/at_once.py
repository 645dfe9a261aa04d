"""Independent jobs started together, for the tests that start processes of their own.

Such a job spends most of its seconds starting Python, jax and MPI, one core
each; started together, jobs that share nothing finish in the time of the
slowest on a machine with cores to spare, instead of in the sum of their times.
"""

import concurrent.futures


def at_once(*jobs):
    """Call each of ``jobs`` (functions without arguments) at the same time; their results in order."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(jobs))) as pool:
        return list(pool.map(lambda job: job(), jobs))
