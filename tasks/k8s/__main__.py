"""``python -m tasks.k8s write-manifests [--check]`` / ``python -m tasks.k8s render STAGE [...]``."""

from __future__ import annotations

import argparse
import sys

from rlhf_core.stages import STAGE_NAMES
from tasks.k8s.manifests import write_manifests
from tasks.k8s.names import DEFAULT_GPU_IMAGE, NAMESPACE, RENDER_KINDS
from tasks.k8s.render_operators import main_render


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.k8s",
                                     description="Render or write the Kubernetes manifests of the stages.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write-manifests", help="regenerate the Job YAML and work-pool template under k8s/")
    w.add_argument("--check", action="store_true", help="only report stale files (exit 1 if any)")
    w.add_argument("--root", default=".")
    r = sub.add_parser("render", help="print a stage's manifest: a Job (default), JobSet, PyTorchJob or TrainJob")
    r.add_argument("stage", choices=STAGE_NAMES)
    r.add_argument("--gpus", type=int)
    r.add_argument("--nnodes", type=int, default=1)
    r.add_argument("--nproc-per-node", type=int)
    r.add_argument("--image", default=DEFAULT_GPU_IMAGE)
    r.add_argument("--namespace", default=NAMESPACE)
    r.add_argument("--queue", help="Kueue LocalQueue (the kueue.x-k8s.io/queue-name label)")
    r.add_argument("--priority-class", help="the pods' priorityClassName")
    r.add_argument("--dvc-remote", help="run the stage under DVC against this remote, as the flow does")
    r.add_argument("--kind", choices=RENDER_KINDS, default="job",
                   help="job (batch/v1; Indexed + headless Service when nnodes > 1), jobset (JobSet, gang restart), "
                        "pytorchjob (Kubeflow Training Operator v1), trainjob (Kubeflow Trainer v2, "
                        "torch-distributed runtime)")
    args = parser.parse_args(argv)
    if args.cmd == "render":
        try:
            extra = {k: v for k, v in {"queue": args.queue, "priority_class": args.priority_class,
                                       "dvc_remote": args.dvc_remote}.items() if v is not None}
            text = main_render(args.stage, kind=args.kind, gpus=args.gpus, nnodes=args.nnodes,
                               nproc_per_node=args.nproc_per_node, image=args.image, namespace=args.namespace, **extra)
        except ValueError as err:
            r.error(str(err))
        sys.stdout.write(text)
        return 0
    stale = write_manifests(args.root, check=args.check)
    for path in stale:
        print(("stale: " if args.check else "wrote: ") + str(path))
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    raise SystemExit(_main())
