"""The last stage (docs/design.md section 9): what a run leaves behind. MLflow tracking, the
result table, the figures and the sweep bookkeeping; they read results and never feed back
into a solve."""
