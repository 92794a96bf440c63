// DsaTopkTranslate: per row, the top-k positions p of logits[r, 0:lengths[r]] translated to slots
// page_table[req_idx[r], p / 64] * 64 + p % 64, -1 where the row has fewer than k candidates.
// Semantics: plugins/reference.py topk_translate (slots only); kernel: dsa_launch_topk_translate.
#include "plugin_common.h"

namespace dsa_trt
{
namespace
{

constexpr int64_t kMaxK = 2048; // dsa_kernels.h: k in 1..2048

class TopkTranslatePlugin : public PluginBase<TopkTranslatePlugin>
{
public:
    enum Input : int32_t
    {
        kLogitsIn = 0,  // [rows, S] fp32
        kLengths = 1,   // [rows] int32
        kPageTable = 2, // [B, max_pages] int32
        kReqIdx = 3,    // [rows] int32
    };
    static constexpr int32_t kSlots = 0; // [rows, k] int32

    static constexpr char kName[] = "DsaTopkTranslate";
    static constexpr FieldSpec kFields[] = {{"k", FieldKind::kInt}};
    static constexpr int32_t kNbInputs = 4;
    static constexpr int32_t kNbOutputs = 1;

    explicit TopkTranslatePlugin(FieldValues const& f)
        : mK(f.intInRange("k", 1, kMaxK))
    {
    }

    void serialize(SerialFields& s) const
    {
        s.addInt("k", &mK);
    }

    bool supportsType(int32_t pos, nv::DynamicPluginTensorDesc const* io) const
    {
        nv::DataType const t = io[pos].desc.type;
        return pos == kLogitsIn ? t == nv::DataType::kFLOAT : t == nv::DataType::kINT32;
    }

    void outputTypes(nv::DataType* out, nv::DataType const* /*in*/) const
    {
        out[kSlots] = nv::DataType::kINT32;
    }

    void outputShapes(nv::DimsExprs const* in, nv::DimsExprs* out, nv::IExprBuilder& eb) const
    {
        DSA_TRT_REQUIRE(in[kLogitsIn].nbDims == 2, "logits must have rank 2, got %d", in[kLogitsIn].nbDims);
        out[kSlots].nbDims = 2;
        out[kSlots].d[0] = in[kLogitsIn].d[0];
        out[kSlots].d[1] = eb.constant(mK);
    }

    void checkShapes(nv::PluginTensorDesc const* in, nv::PluginTensorDesc const* /*out*/) const
    {
        nv::Dims const& logits = in[kLogitsIn].dims;
        nv::Dims const& pageTable = in[kPageTable].dims;
        expectRank(logits, 2, "logits");
        expectRank(in[kLengths].dims, 1, "lengths");
        expectSameDim(in[kLengths].dims, 0, "lengths", logits, 0, "logits");
        expectRank(pageTable, 2, "page_table");
        expectRank(in[kReqIdx].dims, 1, "req_idx");
        expectSameDim(in[kReqIdx].dims, 0, "req_idx", logits, 0, "logits");
        // Every position p < S must have a page table column p / 64 to translate through.
        if (logits.d[1] >= 0 && pageTable.d[1] >= 0)
            DSA_TRT_REQUIRE(logits.d[1] <= pageTable.d[1] * DSA_PAGE_SIZE,
                "logits width %lld exceeds page_table columns * 64 = %lld", static_cast<long long>(logits.d[1]),
                static_cast<long long>(pageTable.d[1] * DSA_PAGE_SIZE));
        if (logits.d[1] >= 0)
            expectInt32(logits.d[1], "logits width");
    }

    // Sized for the profile's largest shape; the kernel needs no more for any smaller one.
    size_t workspaceBytes(nv::DynamicPluginTensorDesc const* in) const
    {
        return dsa_topk_translate_workspace_size(in[kLogitsIn].max.d[0], in[kLogitsIn].max.d[1], mK);
    }

    int launch(nv::PluginTensorDesc const* inDesc, nv::PluginTensorDesc const* /*outDesc*/,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) const
    {
        DsaTopkTranslateParams p{};
        p.logits = static_cast<float const*>(inputs[kLogitsIn]);
        p.lengths = static_cast<int32_t const*>(inputs[kLengths]);
        p.page_table = static_cast<int32_t const*>(inputs[kPageTable]);
        p.req_idx = static_cast<int32_t const*>(inputs[kReqIdx]);
        p.slots = static_cast<int32_t*>(outputs[kSlots]);
        p.indices = nullptr; // the op returns slots only
        p.rows = inDesc[kLogitsIn].dims.d[0];
        p.logits_stride = inDesc[kLogitsIn].dims.d[1];
        p.k = mK;
        p.max_pages = static_cast<int>(inDesc[kPageTable].dims.d[1]);
        p.workspace = workspace;
        if (p.rows == 0)
            return DSA_OK; // empty output: nothing to write
        return dsa_launch_topk_translate(&p, stream);
    }

private:
    int32_t mK; // index_topk, 2048 for V3.2
};

} // namespace

nv::IPluginCreatorV3One& topkTranslateCreator() noexcept
{
    static PluginCreator<TopkTranslatePlugin> creator;
    return creator;
}

} // namespace dsa_trt
