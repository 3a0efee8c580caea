"""Pi0.5 (lerobot/pi05_base): a vision-language-action policy that turns camera images, the
robot's state and a task prompt into a chunk of actions."""
