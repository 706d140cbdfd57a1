"""The generating stages' machinery (grpo, ppo): rollouts, rewards, their losses and the loop.

rollout.py: sampling and per-token log-probs; rewards.py: reward functions; losses.py: the arithmetic;
loop.py: the accelerate loop; grpo.py / ppo.py: one algorithm each; workflow.py: what both stages share
around the loop. The workflows themselves are train/stages/grpo.py and ppo.py.
"""
