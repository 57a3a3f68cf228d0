"""The per-phase device-memory plan of a config (`userrl plan`): the trainer's choreography on a memory ledger."""

from userrl_megatron.plan.planner import MemoryPlan, format_plan, plan_problems, plan_run, plan_warnings

__all__ = ["MemoryPlan", "format_plan", "plan_problems", "plan_run", "plan_warnings"]
