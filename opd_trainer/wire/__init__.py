"""Wire schemas: what crosses a process or outlives one, as typed models owned by neither side.

`schemas`: the JSON bodies the job server answers with and the client parses (`api/` and
`opd_trainer/client/` both import them from here). `driver`: what a job driver reports to whoever
polls it (progress, events) and its recoveries. `checkpoint`: what a checkpoint keeps for a resume, and
the promotion decision.
"""
