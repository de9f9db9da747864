"""Reading tables and images, the input rules shared by training and serving, encoders, data
sets and splits, the corruption suite, and the bounds an input may make the tool allocate."""
