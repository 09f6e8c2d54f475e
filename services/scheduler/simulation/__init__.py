"""The offline harness: the trace-driven simulator and what runs it and reports on it.

- ``simulator``: the event loop on a virtual clock, and how a decision is applied
  there (``sim_job``: the simulator's record of a job; ``queue_order``: the queue kept
  in a policy's fixed order);
- ``runner``: a whole run from a trace, a cluster and a policy (what ``gpusched
  simulate`` and the benchmarks call), ``results``: what a run produced;
- ``report``, ``report_html``, ``result_notes``: the tables, plots, notes and the HTML
  report of one or several runs;
- ``synergy_opt``: Synergy-OPT, the upper bound TUNE is held against.

The policies it runs are those of ``services/scheduler/policies``, the same the live
scheduler (``services/scheduler/live``) runs.
"""
