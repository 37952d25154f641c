"""The autoscaled Ray pools that run user processors: `pool` (the pool and its workers), `autoscaler`
(concurrency-threshold scaling between min and max capacity), `classpath` (loading a processor class
from an uploaded workspace), `sandbox` (bubblewrap confinement of user code), `process_limits` (memory
and process bounds on a sandbox's process tree), `processor_channel` (the trusted end that starts a
sandboxed processor and speaks JSON lines to it), `processor_host` (the program that runs the user's
processor inside the sandbox), `relay` (the byte relays by which a sandbox reaches the job's gateway)
and `requirements` (a workspace's `requirements.txt`, read as package specifiers only). The two pools
users see are `rollout_workers.pool.RolloutPool` and `reward_workers.pool.RewardPool`.
"""
