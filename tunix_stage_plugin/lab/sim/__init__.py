"""`tunix-stage simulate`: predict what staging does to a job from its recorded times, by running
the real core StagePipeline in virtual time against a model of the trainer's resources
(docs/simulate.md)."""
