"""Cost model and exact search (the Planner issue). Pure: never imports torch.distributed."""
