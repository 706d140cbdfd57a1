"""The generating stages' machinery (grpo, ppo): rollouts, rewards, their losses and the loop.

rollout.py: sampling and per-token log-probs; rewards.py: reward functions; losses.py: the arithmetic;
loop.py: the accelerate loop; grpo.py / ppo.py: one algorithm each; workflow.py: the reference, saving and the
closing metrics. The workflow both stages run is train/recipe.py's RLRecipe; train/stages/grpo.py and ppo.py pick
their scorer and algorithm.
"""
