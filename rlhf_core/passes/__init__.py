"""The forward passes, in one place: sampling and the log-prob pass (``generation``), a prompt's KV cache shared by
its group's rows (``prefix_cache``), a group packed into one row (``group_packing``) and the critic's values
(``values``). Every actor, reference, reward and critic forward of RLHF and evaluation goes through here."""
