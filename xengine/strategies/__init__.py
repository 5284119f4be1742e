"""Stage 4 of the pipeline (docs/design.md section 6): XEngine's own exact models and the
searches around them. Every strategy takes an :class:`~xengine.problem.Instance` and returns a
:class:`~xengine.result.StrategyResult`; the baselines (Checkmate and the heuristics) live in
the top-level ``baselines`` package, which imports this one and never the other way round."""
