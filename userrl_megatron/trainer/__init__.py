"""The RL loop on Ray: placement of actor ranks and engines, Megatron worker actors, the driver."""
