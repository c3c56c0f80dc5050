"""What is measured on the running machine: machine facts, row plans and bitwise checks, cost curves."""
