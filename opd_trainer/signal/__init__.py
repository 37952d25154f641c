"""The training signal: what the learner sees of a step's rollouts, made from the teacher's raw scores.

`scores.py` attaches the teacher's scores to each recorded call (the score phase); `shape.py` chains the
shaping steps, each a function from segments to segments plus metrics (`Shaped`, `shaped.py`):
`staleness.py`, `leaks.py` (the leakage check), `hindsight.py` (turn-level hindsight values),
`pairs.py` (preference pairs), `beacons.py` (rewrites with a hindsight beacon). `notes.py` holds the
hindsight notes the teacher scores with and the beacons' header.

Below the driver (which calls it) and beside the learner (whose losses read what it marks): it imports
neither.
"""
