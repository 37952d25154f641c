"""The autoscaled Ray pools that run user processors: `pool` (the pool and its workers), `autoscaler`
(concurrency-threshold scaling between min and max capacity), `classpath` (loading a processor class
from an uploaded workspace), `sandbox` (bubblewrap confinement of user code). The two pools users see
are `rollout_workers.pool.RolloutPool` and `reward_workers.pool.RewardPool`.
"""
