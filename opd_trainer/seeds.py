"""The sampler seed of each request a job makes: distinct per (step, request), reproducible, so a resumed
run samples again exactly what it sampled before."""


def request_seed(job_seed: int, step: int, index: int) -> int:
    """A distinct, reproducible sampler seed per (step, request): resumed runs resample identically."""
    return (job_seed * 1_000_003 + step * 10_007 + index) % (2**31 - 1)
