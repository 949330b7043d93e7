"""The operational modules: what runs the ML around it without changing a number it computes.

Atomic writes and locks, sealing and verifying model folders (integrity), stage metadata and model cards, the
paths of a workspace, MLflow tracking, progress lines, DVC (the stage runner, the shared cache, the remote for
cluster pods), the launcher (torchrun) and the flow watchdog, the serving wrapper. A stage's DVC deps leave this
package out (tests/tasks/test_dvc_pipeline.py): editing it never re-runs the pipeline.
"""
