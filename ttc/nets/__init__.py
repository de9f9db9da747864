"""The networks (ours, torchvision, Hugging Face, a user's module), starting weights, the DSPy
program that trains them, and the language-model teacher."""
