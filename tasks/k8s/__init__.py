"""Kubernetes for the pipeline's stages: the single source of the stage Job's shape, and its submission.

- ``names``: images, namespace, ConfigMaps, service accounts, labels, per-stage defaults;
- ``options``: ``StageJobOptions``, everything a stage Job can be configured with, validated once;
- ``render``: options -> Job (Indexed + headless Service when multi-node), JobSet, Kubeflow PyTorchJob (v1)
  or Kubeflow Trainer v2 TrainJob;
- ``work_pool``: the Prefect Kubernetes work pool's base job template;
- ``manifests``: the generated files under ``k8s/`` (``python -m tasks.k8s write-manifests [--check]``);
- ``submit``: create a Job, follow its logs, wait, explain a failure (the ``kubernetes`` client loads here).

``tests/tasks/k8s/test_k8s_manifests.py`` checks that the committed files are current and that ``kubectl kustomize
k8s/overlays/<name>`` yields exactly the objects ``render`` renders. Importing this package needs neither a
cluster nor Prefect.
"""
